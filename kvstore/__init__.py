"""The sharded key-value store on the conditional-publish WAL (see README.md)."""
