"""Sessions and their storage: the session record, the store, the sessions this process holds
(residency), their durable records and leases, snapshots, and the prefix state cache."""
