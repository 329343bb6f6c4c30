-- The notification outbox (alerting/outbox.py). The table is the one outbox files of
-- earlier releases created, so such a file is adopted as it is; ``revision`` counts the
-- in-place replacements of an entry (a delivery deletes only the revision it sent), and
-- ``outbox_claims`` holds which process delivers a notifier's queue until when.
CREATE TABLE IF NOT EXISTS outbox (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    notifier TEXT NOT NULL,
    fingerprint TEXT NOT NULL,
    state TEXT NOT NULL,
    body TEXT NOT NULL,
    attempts INTEGER NOT NULL DEFAULT 0,
    next_at REAL NOT NULL DEFAULT 0,
    enqueued_at REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS outbox_by_notifier ON outbox (notifier, seq);
CREATE INDEX IF NOT EXISTS outbox_by_alert ON outbox (notifier, fingerprint, seq);
ALTER TABLE outbox ADD COLUMN revision INTEGER NOT NULL DEFAULT 0;
CREATE TABLE IF NOT EXISTS outbox_claims (
    notifier TEXT PRIMARY KEY,
    owner TEXT NOT NULL,
    until_at REAL NOT NULL
);
