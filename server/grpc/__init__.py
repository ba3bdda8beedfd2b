"""The gRPC edge: a thin adapter between sloserve.v1 protobuf and the front end (sloserve.frontend).

server.py builds the grpc.aio server; service.py is the servicer (Stream, Generate, Info);
session.py one Stream call; convert.py protobuf <-> plain data and failure codes -> statuses;
handlers.py lenient request parsing; interceptors.py auth and exceptions -> statuses.
"""
