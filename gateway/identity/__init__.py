"""Who a request is: known API keys (a hashed key file, reloaded when it changes) and
verified users (JWTs checked against a JWKS or a public key). Hands the data plane a
consumer, a tier or a user id; knows nothing of counting.

Nothing is re-exported here, so that importing the pure modules (``config``, ``keys``)
does not pull in the JWKS fetcher's HTTP client.
"""
