-- The incident history (storage/history.py) the weekly report reads, written by the
-- controller pair's leader (``incidents`` is the action store's table: these are
-- ``history_*``).
CREATE TABLE IF NOT EXISTS history_incidents (
    incident_id TEXT PRIMARY KEY, source TEXT NOT NULL, node TEXT NOT NULL,
    entity TEXT NOT NULL, kind TEXT NOT NULL, code TEXT NOT NULL, severity TEXT NOT NULL,
    cause TEXT NOT NULL, detected_at DOUBLE PRECISION NOT NULL,
    out_of_service_at DOUBLE PRECISION, back_in_service_at DOUBLE PRECISION,
    resolved_at DOUBLE PRECISION, model TEXT NOT NULL, driver_version TEXT NOT NULL,
    vbios_version TEXT NOT NULL, slot TEXT NOT NULL, batch TEXT NOT NULL,
    predicted_at DOUBLE PRECISION, actions TEXT NOT NULL, attrs TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS history_incidents_detected ON history_incidents (detected_at);
CREATE TABLE IF NOT EXISTS history_inventory (
    key TEXT PRIMARY KEY, source TEXT NOT NULL, entity TEXT NOT NULL, node TEXT NOT NULL,
    model TEXT NOT NULL, driver_version TEXT NOT NULL, vbios_version TEXT NOT NULL,
    slot TEXT NOT NULL, batch TEXT NOT NULL, first_seen_at DOUBLE PRECISION,
    last_seen_at DOUBLE PRECISION NOT NULL, removed_at DOUBLE PRECISION,
    attrs TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS history_predictions (
    entity TEXT NOT NULL, node TEXT NOT NULL, at DOUBLE PRECISION NOT NULL,
    probability DOUBLE PRECISION NOT NULL, horizon_seconds DOUBLE PRECISION NOT NULL,
    top_features TEXT NOT NULL,
    PRIMARY KEY (entity, node, at)
);
CREATE INDEX IF NOT EXISTS history_predictions_at ON history_predictions (at);
