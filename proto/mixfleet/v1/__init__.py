"""Generated gRPC stubs for package ``mixfleet.v1`` (``python -m protogen``).

Modules: ``inventory_pb2``, ``agent_pb2`` / ``agent_pb2_grpc``, ``plan_pb2`` /
``plan_pb2_grpc``, ``engine_pb2`` / ``engine_pb2_grpc``. Do not edit them by hand.
"""
