"""PostgreSQL support shared by the built-in Store and control plane: the database URL,
the connection settings that bound every wait, the error a request sees when the database
is away, and versioned schema migrations under an advisory lock."""
