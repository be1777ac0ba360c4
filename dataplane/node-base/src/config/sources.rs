//! Where a configuration comes from besides its file, applied to the file's TOML before it is
//! read into [`super::Config`]:
//!
//! - **`SPINDLE_*` variables set any field.** `SPINDLE_LEASE_MS=3000` sets `lease_ms`;
//!   a section's field takes `__` between the names: `SPINDLE_PROVIDER__URL`,
//!   `SPINDLE_MEDIA__UPLOAD__BUCKET`. The value is read as a TOML value (`3000`, `true`,
//!   `[100, 200]`, `[{id = 1, credential = "…"}]`, and a map keyed by names whole:
//!   `SPINDLE_LANES='{EXPENSIVE = {capacity_units = 10}}'`), and as a string when it is not one (a
//!   string that reads as a number is quoted: `SPINDLE_NODE_ID='"42"'`). A variable whose first
//!   name is no field of the configuration is not the node's (`SPINDLE_CONFIG`, a test's
//!   `SPINDLE_TEST_PG`) and is left alone. Flags win over variables, variables over the file.
//! - **Secrets from files.** Wherever a secret goes (`credential`, `token`, `secret`,
//!   `access_key_id`, `secret_access_key`, `session_token`), `NAME_file = "/path"` reads it from
//!   that file instead (its trailing line end dropped): a Kubernetes Secret mounted as files, a
//!   systemd credential. Both forms at once is an error naming the key.

use anyhow::{anyhow, bail, Context};
use serde::de::{self, Deserialize, Deserializer, Visitor};

/// The variables' prefix.
pub const PREFIX: &str = "SPINDLE_";

/// The keys that hold secrets, each of which may come from a file (`NAME_file`).
pub const SECRET_KEYS: [&str; 6] = [
    "credential",
    "token",
    "secret",
    "access_key_id",
    "secret_access_key",
    "session_token",
];

/// A secret read from a file is at most this long (a credential or key, not a document).
pub const SECRET_FILE_BYTES_MAX: u64 = 64 * 1024;

/// The field names a struct type deserializes (as serde hands them to its deserializer): the
/// names a variable's first part must be one of.
pub fn fields_of<'de, T: Deserialize<'de>>() -> &'static [&'static str] {
    struct Fields;
    #[derive(Debug)]
    struct Found(&'static [&'static str]);
    impl std::fmt::Display for Found {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("fields found")
        }
    }
    impl std::error::Error for Found {}
    impl de::Error for Found {
        fn custom<M: std::fmt::Display>(_: M) -> Found {
            Found(&[])
        }
    }
    impl<'de> Deserializer<'de> for Fields {
        type Error = Found;
        fn deserialize_any<V: Visitor<'de>>(self, _: V) -> Result<V::Value, Found> {
            Err(Found(&[]))
        }
        fn deserialize_struct<V: Visitor<'de>>(
            self,
            _: &'static str,
            fields: &'static [&'static str],
            _: V,
        ) -> Result<V::Value, Found> {
            Err(Found(fields))
        }
        serde::forward_to_deserialize_any! {
            bool i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 f32 f64 char str string bytes
            byte_buf option unit unit_struct newtype_struct seq tuple tuple_struct map enum
            identifier ignored_any
        }
    }
    match T::deserialize(Fields) {
        Err(Found(fields)) => fields,
        Ok(_) => &[],
    }
}

/// A variable's value as TOML: a value that parses, else the text as a string.
fn value_of(raw: &str) -> toml::Value {
    match toml::from_str::<toml::Table>(&format!("v = {raw}")) {
        Ok(mut t) => t
            .remove("v")
            .unwrap_or_else(|| toml::Value::String(raw.into())),
        Err(_) => toml::Value::String(raw.into()),
    }
}

/// Sets in `doc` every variable of `vars` that names a field (its first name one of
/// `fields`); the names of those applied, in order.
pub fn overlay_env(
    doc: &mut toml::Table,
    vars: impl IntoIterator<Item = (String, String)>,
    fields: &[&str],
) -> anyhow::Result<Vec<String>> {
    let mut ours: Vec<(String, String)> = vars
        .into_iter()
        .filter(|(name, _)| {
            name.strip_prefix(PREFIX)
                .and_then(|rest| rest.split("__").next())
                .is_some_and(|first| fields.contains(&first.to_ascii_lowercase().as_str()))
        })
        .collect();
    // Sorted, so that a section set whole comes before its fields set one by one.
    ours.sort();
    let mut applied = Vec::new();
    for (name, raw) in ours {
        let path: Vec<String> = name[PREFIX.len()..]
            .split("__")
            .map(str::to_ascii_lowercase)
            .collect();
        if path.iter().any(String::is_empty) {
            bail!("{name}: an empty name between `__`");
        }
        let (last, sections) = path.split_last().expect("at least the first name");
        let mut table = &mut *doc;
        for section in sections {
            let entry = table
                .entry(section.clone())
                .or_insert_with(|| toml::Value::Table(toml::Table::new()));
            table = entry
                .as_table_mut()
                .ok_or_else(|| anyhow!("{name}: `{section}` is not a section"))?;
        }
        table.insert(last.clone(), value_of(&raw));
        applied.push(name);
    }
    Ok(applied)
}

/// Replaces every `NAME_file` of a secret key in `value` (tables and arrays of tables, at any
/// depth) by `NAME` holding the file's text; `at` names where `value` is, for errors.
pub fn read_secret_files(value: &mut toml::Value, at: &str) -> anyhow::Result<()> {
    match value {
        toml::Value::Table(table) => {
            for key in SECRET_KEYS {
                let file_key = format!("{key}_file");
                let Some(path) = table.remove(&file_key) else {
                    continue;
                };
                let here = if at.is_empty() {
                    file_key
                } else {
                    format!("{at}.{file_key}")
                };
                if table.contains_key(key) {
                    bail!("{here}: `{key}` is given too; give the secret one way");
                }
                let path = path
                    .as_str()
                    .ok_or_else(|| anyhow!("{here} must be a path"))?
                    .to_string();
                let size = std::fs::metadata(&path)
                    .with_context(|| format!("{here}: reading {path}"))?
                    .len();
                if size > SECRET_FILE_BYTES_MAX {
                    bail!("{here}: {path} holds {size} bytes, more than a secret's {SECRET_FILE_BYTES_MAX}");
                }
                let text = std::fs::read_to_string(&path)
                    .with_context(|| format!("{here}: reading {path}"))?;
                let secret = text.strip_suffix('\n').unwrap_or(&text);
                let secret = secret.strip_suffix('\r').unwrap_or(secret);
                table.insert(key.to_string(), toml::Value::String(secret.to_string()));
            }
            for (k, v) in table.iter_mut() {
                let here = if at.is_empty() {
                    k.clone()
                } else {
                    format!("{at}.{k}")
                };
                read_secret_files(v, &here)?;
            }
        }
        toml::Value::Array(items) => {
            for (i, v) in items.iter_mut().enumerate() {
                read_secret_files(v, &format!("{at}[{i}]"))?;
            }
        }
        _ => {}
    }
    Ok(())
}
