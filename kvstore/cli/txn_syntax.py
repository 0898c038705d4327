"""The Txn mini-language of `kvstore txn`: one `--if` per compare, one `--then`/`--else` per
operation, each a short string a shell user can type, parsed into the client's `Compare` and `Op`.

Parsed before connecting, so a typo costs no round trip; every error shows the grammar, because
the person who typed it is reading the message.
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence

from kvstore.client import Compare, CompareOp, InvalidArgument, Op

TXN_SYNTAX = """\
Txn syntax (one `--if` per compare, one `--then`/`--else` per operation; all must hold):

    COND := version(KEY) OP INT        OP is one of = == != > <
          | mod_revision(KEY) OP INT   (alias: mod)
          | value(KEY) OP VALUE        (bytewise comparison)
          | exists(KEY) | !exists(KEY) | exists(KEY) = true|false
    OP   := put KEY VALUE | del KEY | delete KEY | get KEY     (shell-quoted words)

A KEY inside parentheses or a VALUE after the operator may be quoted ("a b" or 'a)b'); an
unquoted VALUE is the rest of the condition, trimmed. Example:

    kvstore txn --if 'version(lock)=0' --then 'put lock me' --else 'get lock'

The keys may lie in any shards: over several, the Txn is a cross-shard transaction (atomic and
strictly serializable; its result names the coordinator shard and the decision's revision):

    kvstore txn --if 'value(a)=10' --if 'value(b)=5' --then 'put a 7' --then 'put b 8'

Operators: `kvstore txn list --in-doubt` lists cross-shard transactions prepared and not
resolved (participants, coordinator, age); `kvstore txn resolve TXN` ends one now, with its
coordinator's decision or an abort if there is none.
"""


class TxnSyntaxError(InvalidArgument):
    """A `--if`/`--then`/`--else` argument that does not parse; the message shows the grammar."""


_COMPARE_TARGETS = {"version": "version", "value": "value", "mod_revision": "mod_revision", "mod": "mod_revision",
                    "exists": "exists"}
_CMP_OPERATORS: tuple[tuple[str, CompareOp], ...] = (("==", "=="), ("!=", "!="), ("=", "=="), (">", ">"), ("<", "<"))
_COND_HELP = "expected TARGET(KEY) OP OPERAND, TARGET one of version, value, mod_revision, exists; OP one of = != > <"


def _read_quoted(text: str, i: int) -> tuple[str, int]:
    """A quoted string starting at text[i] (' or "); backslash escapes the quote and itself."""
    quote, out, j = text[i], [], i + 1
    while j < len(text):
        c = text[j]
        if c == "\\" and j + 1 < len(text) and text[j + 1] in (quote, "\\"):
            out.append(text[j + 1])
            j += 2
            continue
        if c == quote:
            return "".join(out), j + 1
        out.append(c)
        j += 1
    raise TxnSyntaxError(f"unterminated quote in {text!r}")


def _skip_spaces(text: str, i: int) -> int:
    while i < len(text) and text[i].isspace():
        i += 1
    return i


def parse_compare(text: str) -> Compare:
    """`version(k)=0`, `value("a b") != x`, `!exists(k)`, `mod(k) < 12` -> a `Compare`."""
    i = _skip_spaces(text, 0)
    negate = text.startswith("!", i)
    if negate:
        i = _skip_spaces(text, i + 1)
    open_paren = text.find("(", i)
    if open_paren < 0:
        raise TxnSyntaxError(f"bad condition {text!r}: {_COND_HELP}")
    name = text[i:open_paren].strip().lower()
    target = _COMPARE_TARGETS.get(name)
    if target is None:
        raise TxnSyntaxError(f"bad condition {text!r}: unknown target {name!r}; {_COND_HELP}")
    if negate and target != "exists":
        raise TxnSyntaxError(f"bad condition {text!r}: '!' only applies to exists(KEY)")
    i = _skip_spaces(text, open_paren + 1)
    if i < len(text) and text[i] in "\"'":
        key, i = _read_quoted(text, i)
        i = _skip_spaces(text, i)
        if not text.startswith(")", i):
            raise TxnSyntaxError(f"bad condition {text!r}: expected ')' after the quoted key")
    else:
        close = text.find(")", i)
        if close < 0:
            raise TxnSyntaxError(f"bad condition {text!r}: missing ')'")
        key, i = text[i:close].strip(), close
    if not key:
        raise TxnSyntaxError(f"bad condition {text!r}: empty key")
    i = _skip_spaces(text, i + 1)
    rest = text[i:]
    if target == "exists":
        if not rest:
            return Compare.exists(key, not negate)
        op, operand = _split_operator(text, rest)
        flag = {"true": True, "1": True, "false": False, "0": False}.get(operand.strip().lower())
        if op not in ("==", "!=") or flag is None:
            raise TxnSyntaxError(f"bad condition {text!r}: exists(KEY) compares with = or != to true or false")
        return Compare.exists(key, (flag == (op == "==")) != negate)
    if not rest:
        raise TxnSyntaxError(f"bad condition {text!r}: missing operator and operand; {_COND_HELP}")
    op, operand = _split_operator(text, rest)
    if target == "value":
        return Compare.value(key, op, _operand_text(text, operand))
    try:
        number = int(operand.strip())
    except ValueError:
        raise TxnSyntaxError(f"bad condition {text!r}: {target} needs an integer, got {operand.strip()!r}") from None
    return Compare.version(key, op, number) if target == "version" else Compare.mod_revision(key, op, number)


def _split_operator(text: str, rest: str) -> tuple[CompareOp, str]:
    for token, op in _CMP_OPERATORS:
        if rest.startswith(token):
            after = rest[len(token):]
            if after.startswith("="):  # ">=", "<=", "===": not in the proto, say so plainly
                break
            return op, after
    raise TxnSyntaxError(f"bad condition {text!r}: operator must be one of = == != > <")


def _operand_text(text: str, operand: str) -> str:
    stripped = operand.strip()
    if stripped[:1] in ("'", '"'):
        value, end = _read_quoted(stripped, 0)
        if stripped[end:].strip():
            raise TxnSyntaxError(f"bad condition {text!r}: text after the quoted value")
        return value
    if not stripped:
        raise TxnSyntaxError(f"bad condition {text!r}: missing value (use \"\" for the empty value)")
    return stripped


def parse_op(text: str) -> Op:
    """`put k v`, `del k`, `get k` (shell-quoted words) -> an `Op`."""
    try:
        words = shlex.split(text)
    except ValueError as exc:
        raise TxnSyntaxError(f"bad operation {text!r}: {exc}") from None
    if not words:
        raise TxnSyntaxError("empty operation; expected put KEY VALUE, del KEY or get KEY")
    verb, args = words[0].lower(), words[1:]
    if verb == "put" and len(args) == 2:
        return Op.put(args[0], args[1])
    if verb in ("del", "delete") and len(args) == 1:
        return Op.delete(args[0])
    if verb == "get" and len(args) == 1:
        return Op.get(args[0])
    raise TxnSyntaxError(f"bad operation {text!r}: expected put KEY VALUE, del KEY or get KEY")


def parse_txn(
    compares: Sequence[str], success: Sequence[str], failure: Sequence[str]
) -> tuple[list[Compare], list[Op], list[Op]]:
    """The `--if`/`--then`/`--else` arguments of `kvstore txn`, parsed."""
    if not (compares or success or failure):
        raise TxnSyntaxError("txn needs at least one --if, --then or --else")
    return [parse_compare(c) for c in compares], [parse_op(o) for o in success], [parse_op(o) for o in failure]
