"""The bus: rove's only way between its parts, JetStream through nats-py.

`client` (`Bus`: publish with dedupe, fencing and retries, subscribe, replay),
`options` (how to reach NATS: URLs, credentials, TLS), `connection` and
`natsclient` (connecting, and the NATS client's callbacks), `feed` (a live
subscription that catches up after a gap), `catchup` (reading a stream's history
fast), `outbox` (publishes that wait out an outage), `records` (stored events
with their sequence), `retry` (which failures to retry, and how), `embedded` (the
`nats-server` a standalone job starts), `auth` (per-role credentials) and
`stored` (a finished job read from its embedded server's store).

Imports the catalogue, `rove.control.errors` and the process support
(`rove.control.process`: metrics, tasks); never the master, the scaler, the agent
or the CLI, which all import it.
"""
