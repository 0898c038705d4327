"""A replica's durable state and its snapshots, on disk: the LevelDB layout (`shard_store`) and
the snapshot format (`snapshot`). One package that a node (`kvstore.server`) and the Spark
pipeline (`kvstore.pipeline`) both import, so the pipeline never reaches into the server and the
two cannot disagree on a byte of either format (docs/development.md, "Packages")."""
