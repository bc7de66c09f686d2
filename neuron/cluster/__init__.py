"""One model across hosts: the group key, the head's directory of nodes, a node's supervisor
(docs/multihost.md)."""
