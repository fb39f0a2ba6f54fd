"""pytest puts this directory on sys.path (it has a conftest and no
__init__.py), so the tests import `support_agent` from a plain checkout."""
