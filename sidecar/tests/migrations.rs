//! Migrations applied to a database that already has rows, on Postgres, MariaDB and SQLite (each
//! test on a database of its own: it changes the schema).
//!
//! 0008 (one business reference per scope, DESIGN §4): references that rows already shared prove
//! neither row, so they are cleared (the reconciler then sends such a row to a person instead of
//! settling it by the other's record); the rest are kept, and from then on the reference is unique.

mod common;

use common::{acq, new_key, Backend, Fixture};
use idem_core::protocol::{AcquireOutcome, AcquireRequest};
use idemd::store::sql::SqlStore;

async fn migration_0008_clears_shared_references_then_holds_them_unique(fx: &Fixture) {
    let store = fx.store_sql_only().await;
    let (a, b, c) = (new_key(), new_key(), new_key());
    let with_ref = |key: &str, r: &str| AcquireRequest { business_ref: Some(r.into()), ..acq(key) };
    for (key, r) in [(&a, "inv-a"), (&b, "inv-b"), (&c, "inv-c")] {
        assert_eq!(store.acquire(&with_ref(key, r)).await.outcome, AcquireOutcome::Acquired);
    }
    // The schema as before 0008, with a reference two rows share (what 0006 allowed).
    let drop_index = match fx.sql {
        Backend::MariaDb => "DROP INDEX idem_record_scope_ref ON idem_record",
        Backend::Postgres | Backend::Sqlite => "DROP INDEX idem_record_scope_ref",
    };
    fx.exec(drop_index).await;
    fx.exec("ALTER TABLE idem_record DROP COLUMN bound_fields").await;
    fx.exec("DELETE FROM idem_schema_migrations WHERE version = 8").await;
    fx.exec(&format!("UPDATE idem_record SET business_ref = 'inv-shared' WHERE idem_key IN ('{a}', '{b}')")).await;

    // A replica of the new version starts and migrates.
    SqlStore::connect(&fx.sql_url, &common::sql_opts()).await.expect("migrate");
    let store = fx.store_sql_only().await;
    let reference = |key: String| {
        let store = store.clone();
        async move { store.sql().get(&key).await.expect("get").expect("row").business_ref }
    };
    assert_eq!(reference(a.clone()).await, None, "{}: a shared reference proves neither row", fx.label());
    assert_eq!(reference(b.clone()).await, None, "{}", fx.label());
    assert_eq!(reference(c.clone()).await.as_deref(), Some("inv-c"), "a reference of its own is kept");
    // And from now on one operation per reference.
    let d = new_key();
    assert_eq!(store.acquire(&with_ref(&d, "inv-c")).await.outcome, AcquireOutcome::ReferenceInUse);
    assert_eq!(store.acquire(&with_ref(&d, "inv-shared")).await.outcome, AcquireOutcome::Acquired);
    assert_eq!(store.acquire(&with_ref(&new_key(), "inv-shared")).await.outcome, AcquireOutcome::ReferenceInUse);
}

macro_rules! on_every_sql_store {
    ($($name:ident),* $(,)?) => {
        mod postgres {
            use super::*;
            $(#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $name() {
                if let Some(fx) = Fixture::isolated(Backend::Postgres, false).await { super::$name(&fx).await }
            })*
        }
        mod mariadb {
            use super::*;
            $(#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $name() {
                if let Some(fx) = Fixture::isolated(Backend::MariaDb, false).await { super::$name(&fx).await }
            })*
        }
        mod sqlite {
            use super::*;
            $(#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $name() {
                if let Some(fx) = Fixture::isolated(Backend::Sqlite, false).await { super::$name(&fx).await }
            })*
        }
    };
}

on_every_sql_store!(migration_0008_clears_shared_references_then_holds_them_unique);
