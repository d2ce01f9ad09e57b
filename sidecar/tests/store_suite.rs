//! The state-machine suite, unchanged on every backend combination:
//! {Redis + SQL, SQL alone} × {Postgres, MariaDB, SQLite}, plus Redis Cluster
//! in front of SQLite.

mod common;

use common::{Backend, Fixture};

macro_rules! scenario_tests {
    ($sql:expr, $redis:expr; $($name:ident),* $(,)?) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn $name() {
                if let Some(fx) = Fixture::new($sql, $redis).await {
                    common::scenarios::$name(&fx).await;
                }
            }
        )*
    };
}

macro_rules! backend_suite {
    ($module:ident, $sql:expr, $redis:expr) => {
        mod $module {
            use super::*;
            scenario_tests!($sql, $redis;
                concurrent_acquires_yield_exactly_one_owner,
                complete_then_acquire_replays_byte_for_byte,
                failed_result_replays_too,
                expired_lease_never_reacquires,
                late_complete_from_old_owner_is_not_owner,
                different_binding_is_param_mismatch,
                release_lets_the_nonce_be_acquired_again,
                repeated_complete_is_idempotent,
                requested_lease_is_never_shorter_than_configured,
                lost_cache_entry_is_refilled_from_the_row,
                needs_review_is_answered_not_reacquired,
                operation_view_follows_the_row,
                complete_that_missed_redis_is_still_seen,
                release_that_missed_redis_frees_the_nonce,
                renewal_extends_the_lease_of_its_owner_only,
                a_business_reference_names_one_operation_per_scope,
            );
        }
    };
}

backend_suite!(redis_postgres, Backend::Postgres, true);
backend_suite!(redis_mariadb, Backend::MariaDb, true);
backend_suite!(redis_sqlite, Backend::Sqlite, true);
backend_suite!(sql_only_postgres, Backend::Postgres, false);
backend_suite!(sql_only_mariadb, Backend::MariaDb, false);
backend_suite!(sql_only_sqlite, Backend::Sqlite, false);

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sqlite_groups_concurrent_commits_each_with_its_audit_line() {
    if let Some(fx) = Fixture::new(Backend::Sqlite, false).await {
        common::scenarios::sqlite_groups_concurrent_commits_each_with_its_audit_line(&fx).await;
    }
}
