"""etcd, the one store: reaching it (client, watch stream), its transactions written as sentences
(txn, ops), the key schema (keys), the deployment scope an owner's writes compare (scope),
Baton's timeouts and error mapping (store, failures), cluster members and releases, and health
that follows it.
"""
