"""What the built-in HTTP APIs (Store, control plane) share: JSON value types for their
models, one readable sentence per rejected request, reading a request into a model, and the
OpenAPI 3.1 document generated from the same models."""
