//! `idemd tools …`: tool definitions for agent builders, generated from the
//! route annotations the filter enforces (`crate::tools`).

use std::path::PathBuf;

use clap::{ArgGroup, Args, ValueEnum};

#[derive(Debug, Clone, Args)]
#[command(group(ArgGroup::new("input").required(true).multiple(true).args(["envoy", "plugin_config"])))]
pub struct ToolsArgs {
    /// An Envoy configuration (YAML): the annotated routes of its static
    /// listeners and the filter's plugin configuration (route rules, defaults).
    /// May be given more than once.
    #[arg(long, value_name = "FILE")]
    pub envoy: Vec<PathBuf>,

    /// A plugin configuration (JSON, as the filter's `configuration.value`):
    /// its route rules. May be given more than once.
    #[arg(long, value_name = "FILE")]
    pub plugin_config: Vec<PathBuf>,

    /// One format; without it, all three in one object
    /// `{"openai": [...], "anthropic": [...], "mcp": [...]}`.
    #[arg(long, value_enum)]
    pub format: Option<ToolFormat>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum ToolFormat {
    /// OpenAI function calling: `{"type": "function", "function": {name, description, parameters}}`.
    Openai,
    /// Anthropic tool use: `{name, description, input_schema}`.
    Anthropic,
    /// MCP `tools/list` entries: `{name, description, inputSchema, annotations}`.
    Mcp,
}
