//! A node's configuration for tests, built instead of pasted: the defaults every test shares
//! (loopback listeners on free ports, two shards, eight partitions, a fast local provider, two
//! tenants) and a call per thing a test changes. `toml()` writes the file spindled reads.

/// The configuration a test node starts with.
#[derive(Debug, Clone)]
pub struct NodeConfig {
    node_id: String,
    shards: u32,
    partitions: u32,
    time_scale: String,
    tenants: Vec<u32>,
    /// TOML lines written inside a tenant's table (its limits, its `[[tenants.quotas]]`).
    tenant_lines: Vec<(u32, String)>,
    /// Top-level `key = value` lines beyond the defaults, in order.
    settings: Vec<String>,
    /// Sections (`[provider]`, `[events]`, …) written after the settings.
    sections: Vec<String>,
}

impl Default for NodeConfig {
    fn default() -> NodeConfig {
        NodeConfig {
            node_id: "test-node".into(),
            shards: 2,
            partitions: 8,
            time_scale: "0.0001".into(),
            tenants: vec![1, 2],
            tenant_lines: Vec::new(),
            settings: Vec::new(),
            sections: Vec::new(),
        }
    }
}

impl NodeConfig {
    pub fn new() -> NodeConfig {
        NodeConfig::default()
    }

    pub fn node_id(mut self, id: &str) -> NodeConfig {
        self.node_id = id.into();
        self
    }

    pub fn shards(mut self, n: u32) -> NodeConfig {
        self.shards = n;
        self
    }

    pub fn partitions(mut self, n: u32) -> NodeConfig {
        self.partitions = n;
        self
    }

    /// The local provider's jobs take their modelled time × `scale`.
    pub fn time_scale(mut self, scale: impl ToString) -> NodeConfig {
        self.time_scale = scale.to_string();
        self
    }

    /// Tenants `ids`, each with the credential `tenant-<id>-credential`.
    pub fn tenants(mut self, ids: impl IntoIterator<Item = u32>) -> NodeConfig {
        self.tenants = ids.into_iter().collect();
        self
    }

    /// Lines for tenant `id`'s table, after its id and credential: settings (`submit_per_minute
    /// = 60`) and its sub-tables (`[[tenants.quotas]]`).
    pub fn tenant_lines(mut self, id: u32, text: &str) -> NodeConfig {
        self.tenant_lines.push((id, text.trim().to_string()));
        self
    }

    /// The partitions this node takes at start, and a takeover grace long enough that it takes
    /// no other while a cluster's nodes start, however slowly (a busy machine).
    pub fn owns(self, partitions: &[u32]) -> NodeConfig {
        let list: Vec<String> = partitions.iter().map(u32::to_string).collect();
        self.set("owned_partitions", format!("[{}]", list.join(", ")))
            .set("takeover_grace_ms", 600_000)
    }

    /// A top-level setting, its value written as TOML (a string must come quoted); it replaces
    /// an earlier `set` of the same key.
    pub fn set(mut self, key: &str, value: impl ToString) -> NodeConfig {
        let prefix = format!("{key} = ");
        self.settings.retain(|line| !line.starts_with(&prefix));
        self.settings.push(format!("{prefix}{}", value.to_string()));
        self
    }

    /// A top-level string setting.
    pub fn set_str(self, key: &str, value: &str) -> NodeConfig {
        self.set(key, format!("{value:?}"))
    }

    /// Top-level settings as TOML lines, written as they are.
    pub fn lines(mut self, text: &str) -> NodeConfig {
        if !text.trim().is_empty() {
            self.settings.push(text.trim_end().to_string());
        }
        self
    }

    /// A whole section, as TOML text starting with its header.
    pub fn section(mut self, text: &str) -> NodeConfig {
        self.sections.push(text.trim().to_string());
        self
    }

    /// The configuration file's text.
    pub fn toml(&self) -> String {
        let mut out = format!(
            "node_id = {:?}\nlisten = \"127.0.0.1:0\"\nhttp_listen = \"127.0.0.1:0\"\n\
             shards = {}\npartitions = {}\nlocal_provider_time_scale = {}\n",
            self.node_id, self.shards, self.partitions, self.time_scale
        );
        for s in &self.settings {
            out.push_str(s);
            out.push('\n');
        }
        for s in &self.sections {
            out.push('\n');
            out.push_str(s);
            out.push('\n');
        }
        for t in &self.tenants {
            out.push_str(&format!(
                "\n[[tenants]]\nid = {t}\ncredential = \"tenant-{t}-credential\"\n"
            ));
            for (_, lines) in self.tenant_lines.iter().filter(|(id, _)| id == t) {
                out.push_str(lines);
                out.push('\n');
            }
        }
        out
    }
}

/// The builder's default is `CONFIG` (run by one test, `e2e.rs`).
pub fn assert_the_default_is_the_shared_config() {
    let built: toml::Value = toml::from_str(&NodeConfig::new().toml()).unwrap();
    let pasted: toml::Value = toml::from_str(super::CONFIG).unwrap();
    assert_eq!(built, pasted);
}
