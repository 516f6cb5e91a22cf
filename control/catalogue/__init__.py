"""The event catalogue: every event type rove's parts exchange on the bus
(`events`, with `data_events`, `scale_events`, `stream_events` and their base
`event_base`), the subjects they travel on (`subjects`: names, wildcards,
validation), and the renderer of `docs/events.md` from them (`eventdoc`).

Pure data and rules (msgspec structs, no I/O, no clock): imports nothing of rove
but itself and `rove.control.errors`. Everything else in rove may import it.
"""
