"""Development tooling, not part of a deployment: the local dev cluster (`make up`) and the
failover demo (`kvstore demo failover`). Needs the `server` extra."""
