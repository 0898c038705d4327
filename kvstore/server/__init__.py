"""A store node: the replica shell around the pure core, leadership, LevelDB, the gRPC services.

Needs the `server` extra (confluent-kafka, plyvel, prometheus-client). Importing this package
imports nothing heavy; `kvstore.server.main` is the process (`kvstore serve`).
"""
