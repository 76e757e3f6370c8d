"""The front end: model loading, capture (aot tracing on fake tensors), fx import, init record, functionalization, optimizer tracing and hints."""
