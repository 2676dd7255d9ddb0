"""Weight sync from the trainer to the rollout engines, in SGLang's wire formats.

`wire.py` builds SGLang's payloads without importing SGLang; `engines.py` talks to the engines'
control endpoints (sessions, cache flush) with SGLang's reply shapes; `transports.py` holds the
`WeightTransport` seam and its registry (`tensor`, `distributed`, `disk`).
"""
