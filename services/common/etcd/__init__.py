"""etcd, the one store: reaching it (client, watch stream), its transactions written as sentences
(txn, ops), the key schema, Baton's timeouts and error mapping (store, failures), cluster
members and releases, and health that follows it.
"""
