//! Reading rules from a file or a directory.

use std::path::Path;

use super::parse::RawFile;
use super::{Domain, FileErrors, RuleError, RuleErrors, RuleSet, compile_file, compile_raw};

/// Files larger than this are rejected, so a runaway file cannot exhaust memory. Rules are
/// small; a client map of a million API keys is about 30 MB.
pub const MAX_FILE_BYTES: u64 = 64 * 1024 * 1024;

/// How a set of files becomes one rule set.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LoadOptions {
    /// Files naming the same domain add their descriptors to it (the reference's
    /// `MERGE_DOMAIN_CONFIG`); a descriptor defined in two of them is still an error. Off: a
    /// second file with a domain is an error.
    pub merge_domains: bool,
}

/// [`load_path_with`] with the default options.
pub fn load_path(path: &Path) -> Result<RuleSet, RuleErrors> {
    load_path_with(path, LoadOptions::default())
}

/// [`load_texts_with`] with the default options.
pub fn load_texts<'a>(
    files: impl IntoIterator<Item = (&'a str, &'a str)>,
) -> Result<RuleSet, RuleErrors> {
    load_texts_with(files, LoadOptions::default())
}

/// Loads `path`: one YAML file, or every `*.yaml`/`*.yml` file in a directory (not recursive;
/// hidden files and Kubernetes ConfigMap internals such as `..data` are skipped; symlinks to
/// files are followed, as ConfigMap volumes need).
pub fn load_path_with(path: &Path, options: LoadOptions) -> Result<RuleSet, RuleErrors> {
    let at = |message: String| {
        RuleErrors(vec![RuleError {
            file: path.display().to_string(),
            location: "path".into(),
            message,
        }])
    };
    let meta = std::fs::metadata(path).map_err(|e| at(format!("cannot read: {e}")))?;
    let files = if meta.is_dir() {
        let mut files = Vec::new();
        let entries = std::fs::read_dir(path).map_err(|e| at(format!("cannot list: {e}")))?;
        for entry in entries {
            let entry = entry.map_err(|e| at(format!("cannot list: {e}")))?;
            let name = entry.file_name();
            let name = name.to_string_lossy();
            let is_yaml = name.ends_with(".yaml") || name.ends_with(".yml");
            if name.starts_with('.') || !is_yaml {
                continue;
            }
            // Follows symlinks: a ConfigMap's files are links into `..data/`.
            if std::fs::metadata(entry.path()).is_ok_and(|m| m.is_file()) {
                files.push(entry.path());
            }
        }
        files.sort();
        files
    } else {
        vec![path.to_path_buf()]
    };
    let mut texts = Vec::with_capacity(files.len());
    let mut errors = Vec::new();
    for file in files {
        let name = file.display().to_string();
        match read_limited(&file) {
            Ok(text) => texts.push((name, text)),
            Err(message) => errors.push(RuleError {
                file: name,
                location: "file".into(),
                message,
            }),
        }
    }
    if !errors.is_empty() {
        return Err(RuleErrors(errors));
    }
    load_texts_with(texts.iter().map(|(n, t)| (n.as_str(), t.as_str())), options)
}

fn read_limited(file: &Path) -> Result<String, String> {
    let len = std::fs::metadata(file)
        .map_err(|e| format!("cannot read: {e}"))?
        .len();
    if len > MAX_FILE_BYTES {
        return Err(format!(
            "file is {len} bytes; rules files are limited to {MAX_FILE_BYTES} bytes"
        ));
    }
    std::fs::read_to_string(file).map_err(|e| format!("cannot read: {e}"))
}

/// Compiles named texts into one rule set; every error of every file is reported.
pub fn load_texts_with<'a>(
    files: impl IntoIterator<Item = (&'a str, &'a str)>,
    options: LoadOptions,
) -> Result<RuleSet, RuleErrors> {
    assemble(
        files
            .into_iter()
            .map(|(name, text)| (name, compile_file(name, text))),
        options,
    )
}

/// Compiles rules already parsed (e.g. decoded from xDS resources), each named for its errors,
/// into one rule set, exactly as files are.
pub fn load_parsed_with<'a>(
    files: impl IntoIterator<Item = (&'a str, &'a RawFile)>,
    options: LoadOptions,
) -> Result<RuleSet, RuleErrors> {
    assemble(
        files
            .into_iter()
            .map(|(name, raw)| (name, compile_raw(name, raw))),
        options,
    )
}

/// One rule set from compiled files: domains joined (or a duplicate reported), client maps
/// merged into their domains.
fn assemble<'a>(
    compiled: impl IntoIterator<Item = (&'a str, Result<Domain, FileErrors>)>,
    options: LoadOptions,
) -> Result<RuleSet, RuleErrors> {
    let mut set = RuleSet::default();
    let mut seen = std::collections::HashSet::new();
    let mut errors = Vec::new();
    let mut maps = Vec::new();
    for (name, result) in compiled {
        let (domain, compiled) = match result {
            // A client map file joins its domain's rules once all files are read.
            Ok(domain) if domain.map_only => {
                maps.push(domain);
                continue;
            }
            Ok(domain) => (Some(domain.name.clone()), Some(domain)),
            Err(mut e) => {
                errors.append(&mut e.errors);
                (e.domain, None)
            }
        };
        if let Some(domain) = domain.filter(|d| !seen.insert(d.clone())) {
            if options.merge_domains {
                // When one of the two had errors of its own, they are reported already.
                if let (Some(into), Some(more)) = (set.domains.get_mut(&domain), compiled) {
                    super::compile::merge_domain(into, more, &mut errors);
                }
                continue;
            }
            errors.push(RuleError {
                file: name.to_owned(),
                location: "domain".into(),
                message: format!("duplicate domain '{domain}' in config file"),
            });
            continue;
        }
        if let Some(compiled) = compiled {
            set.domains.insert(compiled.name.clone(), compiled);
        }
    }
    for map in maps {
        match set.domains.get_mut(&map.name) {
            Some(domain) => super::compile::merge_clients(domain, map, &mut errors),
            None if seen.contains(&map.name) => {} // its domain had errors of its own
            None => errors.push(RuleError {
                file: map.file.clone(),
                location: "domain".into(),
                message: format!(
                    "clients for domain '{}', which no rules file defines",
                    map.name
                ),
            }),
        }
    }
    if errors.is_empty() {
        Ok(set)
    } else {
        Err(RuleErrors(errors))
    }
}
