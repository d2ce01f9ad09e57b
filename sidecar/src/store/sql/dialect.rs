//! What differs between the three SQL backends, and the tools that let one statement text run on
//! each backend's own pool: the backend, the error every call returns, the pools, the bind values
//! and the placeholder rendering. No store logic: the store (`super`) and its parts use these.

use sqlx::mysql::MySqlPool;
use sqlx::postgres::PgPool;
use sqlx::sqlite::SqlitePool;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Backend {
    Postgres,
    MySql,
    Sqlite,
}

impl Backend {
    pub fn from_url(url: &str) -> Option<Self> {
        let scheme = url.split(':').next()?;
        match scheme {
            "postgres" | "postgresql" => Some(Self::Postgres),
            "mysql" | "mariadb" => Some(Self::MySql),
            "sqlite" => Some(Self::Sqlite),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::Postgres => "postgres",
            Self::MySql => "mysql",
            Self::Sqlite => "sqlite",
        }
    }
}

#[derive(Debug)]
pub enum SqlError {
    /// The call did not finish within its budget. It may still have committed.
    Timeout,
    Db(sqlx::Error),
    /// A row this version cannot read (unknown state, unparsable result).
    Corrupt(String),
    Config(String),
}

impl std::fmt::Display for SqlError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Timeout => write!(f, "SQL call timed out"),
            Self::Db(e) => write!(f, "SQL error: {e}"),
            Self::Corrupt(what) => write!(f, "unreadable row: {what}"),
            Self::Config(what) => write!(f, "{what}"),
        }
    }
}

impl std::error::Error for SqlError {}

impl From<sqlx::Error> for SqlError {
    fn from(e: sqlx::Error) -> Self {
        Self::Db(e)
    }
}

#[derive(Clone)]
pub(in crate::store) enum Pool {
    Pg(PgPool),
    My(MySqlPool),
    Lite(SqlitePool),
}

/// Run the same body on whichever concrete pool this store has: the body is
/// compiled once per driver, with that driver's types.
macro_rules! on_pool {
    ($pool:expr, $p:ident => $body:expr) => {
        match $pool {
            $crate::store::sql::Pool::Pg($p) => $body,
            $crate::store::sql::Pool::My($p) => $body,
            $crate::store::sql::Pool::Lite($p) => $body,
        }
    };
}
pub(in crate::store) use on_pool;

/// One bind value. Statements outside the hot path are assembled from these,
/// so one function can run them on all three drivers.
#[derive(Clone, Copy, Debug)]
pub(in crate::store) enum Bind<'a> {
    Text(&'a str),
    OptText(Option<&'a str>),
    Int(i64),
    OptInt(Option<i64>),
}

/// Bind every value of a `&[Bind]` to a query, inside one `on_pool!` arm.
macro_rules! bind_all {
    ($query:expr, $binds:expr) => {{
        let mut q = $query;
        for b in $binds.iter() {
            q = match *b {
                $crate::store::sql::Bind::Text(v) => q.bind(v),
                $crate::store::sql::Bind::OptText(v) => q.bind(v),
                $crate::store::sql::Bind::Int(v) => q.bind(v),
                $crate::store::sql::Bind::OptInt(v) => q.bind(v),
            };
        }
        q
    }};
}
pub(in crate::store) use bind_all;

/// Turn the portable template into the dialect's text: `?` is a parameter and
/// `?k` the key parameter. Postgres numbers its parameters, and must compare
/// the key as CHAR(32): against a TEXT parameter it casts the column instead
/// and no longer uses the primary key index.
pub(in crate::store) fn render(backend: Backend, template: &str) -> String {
    let mut out = String::with_capacity(template.len() + 32);
    let mut n = 0;
    let mut chars = template.chars().peekable();
    while let Some(c) = chars.next() {
        if c != '?' {
            out.push(c);
            continue;
        }
        n += 1;
        let is_key = chars.peek() == Some(&'k');
        if is_key {
            chars.next();
        }
        match (backend, is_key) {
            (Backend::Postgres, true) => out.push_str(&format!("CAST(${n} AS CHAR(32))")),
            (Backend::Postgres, false) => out.push_str(&format!("${n}")),
            _ => out.push('?'),
        }
    }
    out
}
