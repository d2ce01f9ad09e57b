//! The one error of the policy module: a plugin configuration, a route rule or a route annotation
//! that is refused. The message names the field (`routes[2].match.path: …`), which is all an
//! operator needs and all a host logs.

use std::fmt;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Error(pub String);

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Error {}
