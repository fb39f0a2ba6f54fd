"""Sealed segments: a session's event stream and model history, past their
open tails, in an object store (docs/storage.md, docs/design.md §13).

etcd keeps what must be linearizable and fenced, and each log's open tail;
a full segment of a log is written once as an immutable object and recorded
by one guarded etcd transaction that deletes its keys. The layers:

- objects.py: the object store (obstore), bounded calls, typed failures;
- format.py: an object's bytes (header, checksum, payload) and its name;
- index.py: a log's segment index, as rules without I/O;
- log.py: reading a log's segments back, checked;
- seal.py: sealing one tail (the steps and their failpoints);
- schedule.py: when sealing runs (off the commit's path);
- history.py: `HistoryStore` over segments and the tail;
- trim.py: the stream horizon's `StreamRetirement` over segments;
- sweep.py: deleting a session's objects, and the orphan sweep.

Only anchor uses this package.
"""
