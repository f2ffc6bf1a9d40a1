"""Generated gRPC/protobuf stubs (``python -m itif.server.gen``). Do not edit."""
