//! The service's one router: the REST routes (`api`) and, unless `--no-mcp`, the MCP endpoints
//! (`mcp`), over one shared `App`. It sits above both so the MCP server can reuse the REST
//! service's operations without the REST module knowing MCP exists.

use crate::app::{App, Config};
use crate::store::Store;
use crate::{api, mcp};
use axum::Router;
use std::sync::Arc;

pub fn router(store: Store, config: Config) -> Router {
    let app = App { store, config: Arc::new(config) };
    let rest = api::router(app.clone());
    if app.config.mcp {
        rest.merge(mcp::router(app))
    } else {
        rest
    }
}
