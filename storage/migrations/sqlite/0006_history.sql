-- The incident history (storage/history.py). The three tables are created as history
-- files of earlier releases have them (so such a file is adopted as it is), then given
-- the names they have in the controller pair's shared PostgreSQL schema, where
-- ``incidents`` is the action store's.
CREATE TABLE IF NOT EXISTS incidents (
    incident_id TEXT PRIMARY KEY, source TEXT NOT NULL, node TEXT NOT NULL,
    entity TEXT NOT NULL, kind TEXT NOT NULL, code TEXT NOT NULL, severity TEXT NOT NULL,
    cause TEXT NOT NULL, detected_at REAL NOT NULL, out_of_service_at REAL,
    back_in_service_at REAL, resolved_at REAL, model TEXT NOT NULL,
    driver_version TEXT NOT NULL, vbios_version TEXT NOT NULL, slot TEXT NOT NULL,
    batch TEXT NOT NULL, predicted_at REAL, actions TEXT NOT NULL, attrs TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS incidents_detected ON incidents (detected_at);
CREATE TABLE IF NOT EXISTS inventory (
    key TEXT PRIMARY KEY, source TEXT NOT NULL, entity TEXT NOT NULL, node TEXT NOT NULL,
    model TEXT NOT NULL, driver_version TEXT NOT NULL, vbios_version TEXT NOT NULL,
    slot TEXT NOT NULL, batch TEXT NOT NULL, first_seen_at REAL, last_seen_at REAL NOT NULL,
    removed_at REAL, attrs TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS predictions (
    entity TEXT NOT NULL, node TEXT NOT NULL, at REAL NOT NULL, probability REAL NOT NULL,
    horizon_seconds REAL NOT NULL, top_features TEXT NOT NULL,
    PRIMARY KEY (entity, node, at)
);
CREATE INDEX IF NOT EXISTS predictions_at ON predictions (at);
ALTER TABLE incidents RENAME TO history_incidents;
ALTER TABLE inventory RENAME TO history_inventory;
ALTER TABLE predictions RENAME TO history_predictions
