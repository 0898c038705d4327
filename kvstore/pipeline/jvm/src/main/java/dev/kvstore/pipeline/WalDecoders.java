package dev.kvstore.pipeline;

import com.google.protobuf.ByteString;
import com.google.protobuf.DescriptorProtos.FileDescriptorProto;
import com.google.protobuf.DescriptorProtos.FileDescriptorSet;
import com.google.protobuf.Descriptors.Descriptor;
import com.google.protobuf.Descriptors.FieldDescriptor;
import com.google.protobuf.Descriptors.FileDescriptor;
import com.google.protobuf.Descriptors.OneofDescriptor;
import com.google.protobuf.DynamicMessage;
import com.google.protobuf.InvalidProtocolBufferException;
import java.io.IOException;
import java.io.InputStream;
import java.util.ArrayList;
import java.util.HashMap;
import java.util.List;
import java.util.Map;
import org.apache.spark.sql.Row;
import org.apache.spark.sql.RowFactory;
import org.apache.spark.sql.api.java.UDF1;

/**
 * Decoders of the WAL's two protobuf messages as Spark SQL functions that run in the JVM.
 *
 * <p>They stand in for spark-protobuf's {@code from_protobuf}, which the project cannot fetch
 * (see kvstore/pipeline/jvm/pom.xml), and keep its contract: the schema comes from a descriptor
 * set of the stubs generated from proto/ (embedded as a resource), bytes that do not parse give
 * NULL, never a failed job. Each decoder mirrors the Python reader it must agree with:
 * {@code wal.record.judge} for a record's envelope and {@code kvstore.core.entries.decode_entry} for
 * the store's entry (an effect without a kind makes the whole entry malformed). The tests hold
 * them together on the same bytes.
 */
public final class WalDecoders {
  private static final String DESCRIPTORS = "/kvstore-wal.desc";
  private static final Descriptor RECORD;
  private static final Descriptor ENTRY;

  static {
    Map<String, Descriptor> messages = load();
    RECORD = require(messages, "wal.v1.Record");
    ENTRY = require(messages, "kvstore.internal.v1.WalEntry");
  }

  private WalDecoders() {}

  /** wal.v1.Record -> struct(expected_offset, writer_id, writer_term, payload); NULL if it does not parse. */
  public static final class DecodeRecord implements UDF1<byte[], Row> {
    private static final long serialVersionUID = 1L;
    private static final FieldDescriptor EXPECTED = RECORD.findFieldByName("expected_offset");
    private static final FieldDescriptor WRITER = RECORD.findFieldByName("writer");
    private static final FieldDescriptor PAYLOAD = RECORD.findFieldByName("payload");
    private static final FieldDescriptor WRITER_ID = WRITER.getMessageType().findFieldByName("id");
    private static final FieldDescriptor WRITER_TERM = WRITER.getMessageType().findFieldByName("term");

    @Override
    public Row call(byte[] value) {
      if (value == null) {
        return null;
      }
      DynamicMessage record;
      try {
        record = DynamicMessage.parseFrom(RECORD, value);
      } catch (InvalidProtocolBufferException e) {
        return null;
      }
      DynamicMessage writer = (DynamicMessage) record.getField(WRITER);
      return RowFactory.create(
          (Long) record.getField(EXPECTED),
          (String) writer.getField(WRITER_ID),
          (Long) writer.getField(WRITER_TERM),
          ((ByteString) record.getField(PAYLOAD)).toByteArray());
    }
  }

  /**
   * kvstore.internal.v1.WalEntry -> struct(request_id, effects array(struct(kind, key, value)), response,
   * leader_unix_ms, txn); NULL if it does not parse or an effect has no kind. {@code txn} is NULL but
   * for a cross-shard transaction's record: struct(kind 'prepare'|'decision'|'resolve'|'forget', txn_id
   * (NULL for a forget, which has none), commit, succeeded, coordinator, participants, records: how many
   * of the four the entry holds, which kvstore.core.state.txn_record_rule refuses when not 1, txn_ids:
   * the decisions a forget removes, empty for the other kinds). The struct describes the first of them,
   * in this order.
   */
  public static final class DecodeEntry implements UDF1<byte[], Row> {
    private static final long serialVersionUID = 1L;
    private static final FieldDescriptor REQUEST_ID = ENTRY.findFieldByName("request_id");
    private static final FieldDescriptor EFFECTS = ENTRY.findFieldByName("effects");
    private static final FieldDescriptor RESPONSE = ENTRY.findFieldByName("response");
    private static final FieldDescriptor LEADER_MS = ENTRY.findFieldByName("leader_unix_ms");
    private static final Descriptor EFFECT = EFFECTS.getMessageType();
    private static final OneofDescriptor KIND = EFFECT.getOneofs().get(0);
    private static final FieldDescriptor PUT = EFFECT.findFieldByName("put");
    private static final FieldDescriptor PUT_KEY = PUT.getMessageType().findFieldByName("key");
    private static final FieldDescriptor PUT_VALUE = PUT.getMessageType().findFieldByName("value");
    private static final FieldDescriptor DELETE = EFFECT.findFieldByName("delete");
    private static final FieldDescriptor DELETE_KEY = DELETE.getMessageType().findFieldByName("key");
    private static final String[] TXN_KINDS = {"prepare", "decision", "resolve", "forget"};

    @Override
    public Row call(byte[] payload) {
      if (payload == null) {
        return null;
      }
      DynamicMessage entry;
      try {
        entry = DynamicMessage.parseFrom(ENTRY, payload);
      } catch (InvalidProtocolBufferException e) {
        return null;
      }
      int count = entry.getRepeatedFieldCount(EFFECTS);
      List<Row> effects = new ArrayList<>(count);
      for (int i = 0; i < count; i++) {
        DynamicMessage effect = (DynamicMessage) entry.getRepeatedField(EFFECTS, i);
        FieldDescriptor kind = effect.getOneofFieldDescriptor(KIND);
        if (kind == null) {
          return null;
        }
        if (kind.equals(PUT)) {
          DynamicMessage put = (DynamicMessage) effect.getField(PUT);
          effects.add(RowFactory.create("put", bytes(put, PUT_KEY), bytes(put, PUT_VALUE)));
        } else {
          DynamicMessage delete = (DynamicMessage) effect.getField(DELETE);
          effects.add(RowFactory.create("delete", bytes(delete, DELETE_KEY), null));
        }
      }
      return RowFactory.create(
          (String) entry.getField(REQUEST_ID),
          effects,
          ((ByteString) entry.getField(RESPONSE)).toByteArray(),
          (Long) entry.getField(LEADER_MS),
          txn(entry));
    }

    private static Row txn(DynamicMessage entry) {
      Row found = null;
      int records = 0;
      for (String kind : TXN_KINDS) {
        FieldDescriptor field = ENTRY.findFieldByName(kind);
        if (field == null || !entry.hasField(field)) {
          continue;
        }
        records++;
        if (found == null) {
          DynamicMessage m = (DynamicMessage) entry.getField(field);
          Descriptor d = m.getDescriptorForType();
          List<Integer> participants = new ArrayList<>();
          FieldDescriptor parts = d.findFieldByName("participants");
          if (parts != null) {
            for (int i = 0; i < m.getRepeatedFieldCount(parts); i++) {
              participants.add((Integer) m.getRepeatedField(parts, i));
            }
          }
          List<String> txnIds = new ArrayList<>();
          FieldDescriptor ids = d.findFieldByName("txn_ids");
          if (ids != null) {
            for (int i = 0; i < m.getRepeatedFieldCount(ids); i++) {
              txnIds.add((String) m.getRepeatedField(ids, i));
            }
          }
          found = RowFactory.create(kind, text(m, d, "txn_id"), flag(m, d, "commit"), flag(m, d, "succeeded"),
              number(m, d, "coordinator"), participants, 0, txnIds);
        }
      }
      if (found == null) {
        return null;
      }
      return RowFactory.create(found.get(0), found.get(1), found.get(2), found.get(3), found.get(4), found.get(5),
          records, found.get(7));
    }

    private static String text(DynamicMessage m, Descriptor d, String name) {
      FieldDescriptor field = d.findFieldByName(name);
      return field == null ? null : (String) m.getField(field);
    }

    private static Boolean flag(DynamicMessage m, Descriptor d, String name) {
      FieldDescriptor field = d.findFieldByName(name);
      return field == null ? null : (Boolean) m.getField(field);
    }

    private static Integer number(DynamicMessage m, Descriptor d, String name) {
      FieldDescriptor field = d.findFieldByName(name);
      return field == null ? null : (Integer) m.getField(field);
    }

    private static byte[] bytes(DynamicMessage message, FieldDescriptor field) {
      return ((ByteString) message.getField(field)).toByteArray();
    }
  }

  private static Map<String, Descriptor> load() {
    FileDescriptorSet set;
    try (InputStream in = WalDecoders.class.getResourceAsStream(DESCRIPTORS)) {
      if (in == null) {
        throw new IllegalStateException(DESCRIPTORS + " is missing from the jar: rebuild it (make spark)");
      }
      set = FileDescriptorSet.parseFrom(in);
    } catch (IOException e) {
      throw new IllegalStateException("cannot read " + DESCRIPTORS, e);
    }
    // Dependencies come before their dependents (today neither message imports another file).
    Map<String, FileDescriptor> files = new HashMap<>();
    Map<String, Descriptor> messages = new HashMap<>();
    for (FileDescriptorProto proto : set.getFileList()) {
      FileDescriptor[] deps = new FileDescriptor[proto.getDependencyCount()];
      for (int i = 0; i < deps.length; i++) {
        deps[i] = files.get(proto.getDependency(i));
      }
      FileDescriptor file;
      try {
        file = FileDescriptor.buildFrom(proto, deps);
      } catch (com.google.protobuf.Descriptors.DescriptorValidationException e) {
        throw new IllegalStateException("bad descriptor " + proto.getName(), e);
      }
      files.put(proto.getName(), file);
      for (Descriptor message : file.getMessageTypes()) {
        messages.put(message.getFullName(), message);
      }
    }
    return messages;
  }

  private static Descriptor require(Map<String, Descriptor> messages, String name) {
    Descriptor d = messages.get(name);
    if (d == null) {
      throw new IllegalStateException(name + " is not in " + DESCRIPTORS);
    }
    return d;
  }
}
