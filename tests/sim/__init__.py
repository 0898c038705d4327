"""A deterministic simulation of the whole store protocol (issue 11, item 2).

The real pure cores (`wal.guard`, `wal.record`, `kvstore.core.role`, `kvstore.core.batch`,
`kvstore.core.evaluate`, `kvstore.core.request_window`, `kvstore.core.state`) run against
models of everything around them: a Kafka broker with transactions (`kafka`), a consumer group
(`group`), a network (`network`), nodes that crash and pause (`node`, `replica`, `writer`),
clients with request ids (`client`), faults (`faults`), all on one seeded scheduler
(`scheduler`). With placement, the placement controller's machine (`kvstore.core.placement_controller`)
runs in the elected node's shell (`controller`), every node follows the placement log
(`following`, around `kvstore.core.placement_follower`), and operators drain and move (`operator`).
`checker`, `placement_checker` and `linearizability` judge each run; `harness` ties a run together.
See README, "Deterministic simulation".
"""
