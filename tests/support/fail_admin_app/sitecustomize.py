"""Loaded by a gateway process started with this folder on PYTHONPATH: with
GATEWAY_TEST_FAIL_ADMIN_APP=1, building the admin application raises, as an unexpected
failure late in a start would (fault injection for the supervisor's start-up path)."""

import os

if os.environ.get("GATEWAY_TEST_FAIL_ADMIN_APP") == "1":
    import gateway.proxy.admin as admin

    def _failing(*args, **kwargs):
        raise RuntimeError("injected: the admin application could not be built")

    admin.create_admin_app = _failing
