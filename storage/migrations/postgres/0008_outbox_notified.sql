-- Which alerts the notifiers were told are firing (alerting/routing.py): a restarted
-- service or a new leader does not tell them again what was sent before.
CREATE TABLE IF NOT EXISTS outbox_notified (
    fingerprint TEXT PRIMARY KEY,
    body TEXT NOT NULL,
    notified_at DOUBLE PRECISION NOT NULL
);
