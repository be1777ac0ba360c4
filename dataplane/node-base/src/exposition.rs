//! Prometheus text exposition, grouped and checked. The node's metrics are written as text by
//! the parts that own them, each family with a `# HELP` and a `# TYPE` line; [`Exposition`]
//! reads that text back and writes each family once, in the order it first appeared, its help
//! and type first and its samples together (a scraper or `promtool` refuses a family declared
//! twice or split), and lists what is wrong: a family without a type or help, declared twice.
//! Label values that come from outside the code (names in the configuration or the policy
//! store) go through [`label`] where they are written.

use std::borrow::Cow;
use std::collections::HashMap;

/// A label value as the text format wants it: backslash, double quote and line feed escaped.
pub fn label(value: &str) -> Cow<'_, str> {
    if !value.contains(['\\', '"', '\n']) {
        return Cow::Borrowed(value);
    }
    let mut out = String::with_capacity(value.len() + 4);
    for c in value.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '"' => out.push_str("\\\""),
            '\n' => out.push_str("\\n"),
            c => out.push(c),
        }
    }
    Cow::Owned(out)
}

/// A part of the node that writes its own families (a collector, in the words of Prometheus's
/// client libraries): the counters every part writes (`metrics::Metrics`), and the parts that
/// keep state of their own (the media pool, the live policy). The HTTP port renders a list of
/// them ([`Exposition::collect`]); none of them knows the others.
pub trait Collect: Send + Sync {
    /// Appends this part's families, as exposition text, to `w`.
    fn collect(&self, w: &mut String);
}

/// One family as read.
#[derive(Default)]
struct Family {
    name: String,
    help: Option<String>,
    kind: Option<String>,
    samples: Vec<String>,
}

/// Exposition text regrouped by family, and what was wrong with it.
pub struct Exposition {
    pub text: String,
    /// One line per problem: a family without `# TYPE` or `# HELP`, or with two of either.
    pub problems: Vec<String>,
}

impl Exposition {
    /// Every part's families, grouped.
    pub fn collect(parts: &[&dyn Collect]) -> Exposition {
        let mut raw = String::new();
        for part in parts {
            part.collect(&mut raw);
        }
        Exposition::group(&raw)
    }

    /// Regroups `raw` (lines of exposition text) by family.
    pub fn group(raw: &str) -> Exposition {
        let mut families: Vec<Family> = Vec::new();
        let mut index: HashMap<String, usize> = HashMap::new();
        let mut problems = Vec::new();
        fn at(families: &mut Vec<Family>, index: &mut HashMap<String, usize>, name: &str) -> usize {
            *index.entry(name.to_string()).or_insert_with(|| {
                families.push(Family {
                    name: name.to_string(),
                    ..Family::default()
                });
                families.len() - 1
            })
        }
        for line in raw.lines().filter(|l| !l.trim().is_empty()) {
            if let Some(rest) = line.strip_prefix("# HELP ") {
                let (name, help) = rest.split_once(' ').unwrap_or((rest, ""));
                let f = at(&mut families, &mut index, name);
                if families[f].help.replace(help.to_string()).is_some() {
                    problems.push(format!("{name}: a second HELP"));
                }
            } else if let Some(rest) = line.strip_prefix("# TYPE ") {
                let (name, kind) = rest.split_once(' ').unwrap_or((rest, "untyped"));
                let f = at(&mut families, &mut index, name);
                if families[f].kind.replace(kind.to_string()).is_some() {
                    problems.push(format!("{name}: a second TYPE"));
                }
            } else if line.starts_with('#') {
                continue;
            } else {
                let name = line.split(['{', ' ']).next().unwrap_or(line);
                let family = ["_bucket", "_sum", "_count"]
                    .iter()
                    .filter_map(|suffix| name.strip_suffix(suffix))
                    .find(|base| {
                        index.get(*base).is_some_and(|&f| {
                            matches!(families[f].kind.as_deref(), Some("histogram" | "summary"))
                        })
                    })
                    .unwrap_or(name)
                    .to_string();
                let f = at(&mut families, &mut index, &family);
                families[f].samples.push(line.to_string());
            }
        }
        let mut text = String::with_capacity(raw.len());
        for f in &families {
            match &f.help {
                Some(help) => text.push_str(&format!("# HELP {} {help}\n", f.name)),
                None => problems.push(format!("{}: no HELP", f.name)),
            }
            match &f.kind {
                Some(kind) => text.push_str(&format!("# TYPE {} {kind}\n", f.name)),
                None => problems.push(format!("{}: no TYPE", f.name)),
            }
            for s in &f.samples {
                text.push_str(s);
                text.push('\n');
            }
        }
        Exposition { text, problems }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn families_written_apart_come_out_together_with_their_help_and_type() {
        let raw = "# HELP a_total A.\n# TYPE a_total counter\na_total{x=\"1\"} 1\n\
                   # HELP h Hist.\n# TYPE h histogram\nh_bucket{le=\"1\"} 2\nh_sum 3\n\
                   a_total{x=\"2\"} 4\nh_count 2\n";
        let e = Exposition::group(raw);
        assert!(e.problems.is_empty(), "{:?}", e.problems);
        assert_eq!(
            e.text,
            "# HELP a_total A.\n# TYPE a_total counter\na_total{x=\"1\"} 1\na_total{x=\"2\"} 4\n\
             # HELP h Hist.\n# TYPE h histogram\nh_bucket{le=\"1\"} 2\nh_sum 3\nh_count 2\n"
        );
    }

    #[test]
    fn a_family_declared_twice_or_not_at_all_is_named() {
        let raw = "# HELP q Q.\n# TYPE q gauge\nq 1\n# HELP q Q again.\n# TYPE q gauge\nq 2\n\
                   loose 3\n# TYPE quiet gauge\nquiet 0\n";
        let e = Exposition::group(raw);
        assert_eq!(
            e.problems,
            [
                "q: a second HELP",
                "q: a second TYPE",
                "loose: no HELP",
                "loose: no TYPE",
                "quiet: no HELP"
            ]
        );
    }

    #[test]
    fn label_values_are_escaped() {
        assert_eq!(label("acme-1"), "acme-1");
        assert_eq!(label("a\"b\\c\nd"), "a\\\"b\\\\c\\nd");
    }
}
