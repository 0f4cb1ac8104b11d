"""Generated gRPC stubs of eps.v1 (tools/generate_stubs.py); do not edit."""
