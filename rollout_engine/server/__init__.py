"""The server: one front door to the engine (`AsyncEngine`: the engine thread, admission) and
the protocols over it: gRPC (servicer, wire conversion, weight receiving) and HTTP (`http/`).

Only this package (and `trainer_bridge`) imports the generated `protos` stubs.
"""
