"""Storage: datastores (plain and sharded), FAISS indexes and searchers, the self-describing folder."""
