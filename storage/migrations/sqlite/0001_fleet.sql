CREATE TABLE IF NOT EXISTS fleet_records (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    key TEXT NOT NULL UNIQUE,
    node TEXT NOT NULL,
    kind TEXT NOT NULL,
    at REAL NOT NULL,
    body TEXT NOT NULL,
    accepted_at REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS fleet_records_at ON fleet_records (at);
CREATE TABLE IF NOT EXISTS fleet_agents (
    node TEXT PRIMARY KEY,
    version TEXT NOT NULL,
    gpus TEXT NOT NULL,
    first_seen_at REAL NOT NULL,
    last_heartbeat_at REAL NOT NULL
);
