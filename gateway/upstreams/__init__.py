"""Built-in upstream services the gateway can run in-process on their own loopback sockets."""
