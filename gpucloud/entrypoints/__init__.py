"""The processes of gpucloud, one module each: what `gpucloud <command>` (and `gpucloud up`) runs.

Each builds its app from its routers and takes every adapter from `gpucloud.bootstrap`:
`api` (the HTTP API), `worker` (the Temporal workers), `ledger` (the billing ledger),
`tracker` (the weight tracker and origin), `agent` (the host agent on a node), `simulators`
(the simulated fleet, BMC emulator and fabric managers), `codec_server` (the Temporal payload
decoder for operators).
"""
