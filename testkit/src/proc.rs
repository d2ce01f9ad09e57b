//! Child processes that die with the test (SIGKILL, like an OOM kill or an
//! evicted pod), their output in a log file printed when they fail to start.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

pub type BoxError = crate::BoxError;

/// A child process that is killed when dropped; its output goes to a log file
/// that is printed if the test fails to start it.
pub struct Proc {
    name: String,
    child: Option<Child>,
    pub log: PathBuf,
}

impl Proc {
    pub fn spawn(name: &str, cmd: &mut Command, dir: &Path) -> Result<Proc, BoxError> {
        let log = dir.join(format!("{name}.log"));
        let out = std::fs::OpenOptions::new().create(true).append(true).open(&log)?;
        let child = cmd.stdin(Stdio::null()).stdout(out.try_clone()?).stderr(out).spawn()?;
        Ok(Proc { name: name.to_owned(), child: Some(child), log })
    }

    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// SIGKILL, like an OOM kill or an evicted pod.
    pub fn kill9(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    pub fn exited(&mut self) -> bool {
        match self.child.as_mut() {
            Some(c) => matches!(c.try_wait(), Ok(Some(_))),
            None => true,
        }
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    pub fn name(&self) -> &str {
        &self.name
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill9();
    }
}
