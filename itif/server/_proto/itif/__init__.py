"""Generated gRPC/protobuf stubs (``python -m itif.server.protogen``). Do not edit."""
