"""pytest puts this directory on sys.path (it has a conftest and no
__init__.py), so the tests import `webhook_gateway` from a plain checkout."""
