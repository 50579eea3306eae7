"""The gRPC server: servicer, wire conversion, weight receiving, the engine thread, admission.

Only this package (and `trainer_bridge`) imports the generated `protos` stubs.
"""
