"""The store's protocol as pure functions and state machines: no Kafka, no LevelDB, no gRPC, no
clock of its own. The server's shells and the deterministic simulation (tests/sim) drive the
same code; see docs/development.md, "Packages"."""
