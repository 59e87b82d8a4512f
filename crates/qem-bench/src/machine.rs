//! What machine and revision a benchmark ran on.

use std::process::Command;

/// The machine a record was made on.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Machine {
    /// Host name.
    pub hostname: String,
    /// CPU model name (`/proc/cpuinfo`).
    pub cpu_model: String,
    /// Logical CPUs this process may use.
    pub logical_cpus: usize,
    /// Worker threads of the rayon pool.
    pub rayon_threads: usize,
    /// Total memory in bytes (`/proc/meminfo`), if known.
    pub memory_bytes: Option<u64>,
    /// Operating system and architecture.
    pub os: String,
}

fn first_line_value(text: &str, key: &str) -> Option<String> {
    text.lines()
        .find(|l| l.starts_with(key))
        .and_then(|l| l.split(':').nth(1))
        .map(|v| v.trim().to_string())
}

/// Describe this machine.
pub fn machine() -> Machine {
    let hostname = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .or_else(|| std::env::var("HOSTNAME").ok())
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "unknown-host".into());
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    Machine {
        hostname,
        cpu_model: first_line_value(&cpuinfo, "model name")
            .unwrap_or_else(|| std::env::consts::ARCH.into()),
        logical_cpus: std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1),
        rayon_threads: rayon::current_num_threads(),
        memory_bytes: first_line_value(&meminfo, "MemTotal")
            .and_then(|v| v.split_whitespace().next()?.parse::<u64>().ok())
            .map(|kib| kib * 1024),
        os: format!("{}-{}", std::env::consts::OS, std::env::consts::ARCH),
    }
}

/// `QEM_GIT_REVISION` when set (bench/device.sh sets it from the carry's REVISION: the tree
/// the binaries were built from, where a copied checkout's `.git` may name an older commit),
/// else `git rev-parse HEAD` in the current directory (plus `-dirty` when the tree has
/// changes), else the revision the library was built from.
pub fn git_revision() -> String {
    if let Some(rev) = std::env::var("QEM_GIT_REVISION")
        .ok()
        .filter(|r| !r.is_empty() && r != "unknown")
    {
        return rev;
    }
    let run = |args: &[&str]| {
        Command::new("git")
            .args(args)
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
    };
    match run(&["rev-parse", "HEAD"]) {
        Some(rev) if !rev.is_empty() => {
            let dirty = run(&["status", "--porcelain", "--untracked-files=no"])
                .is_some_and(|s| !s.is_empty());
            if dirty {
                format!("{rev}-dirty")
            } else {
                rev
            }
        }
        _ => qem::GIT_REVISION.to_string(),
    }
}

/// When and where a benchmark or generator record was made.
#[derive(Debug, Clone)]
pub struct RecordStamp {
    /// UTC date, `YYYY-MM-DD`.
    pub date: String,
    /// UTC time, `HH:MM:SS`.
    pub time: String,
    /// This machine.
    pub machine: Machine,
}

impl RecordStamp {
    /// Now, on this machine.
    pub fn now() -> RecordStamp {
        let (date, time) = utc_now();
        RecordStamp {
            date,
            time,
            machine: machine(),
        }
    }

    /// The JSON object `fields` with the fields every record carries added: `command`,
    /// `git_revision`, `package_version`, `date_utc`, `time_utc` and `machine`.
    pub fn record(&self, command_line: &str, mut fields: serde_json::Value) -> serde_json::Value {
        let common = serde_json::json!({
            "command": command_line,
            "git_revision": git_revision(),
            "package_version": env!("CARGO_PKG_VERSION"),
            "date_utc": self.date,
            "time_utc": self.time,
            "machine": self.machine,
        });
        if let (Some(to), serde_json::Value::Object(from)) = (fields.as_object_mut(), common) {
            to.extend(from);
        }
        fields
    }

    /// The record's file name, `{kind}_{hostname}_{date}T{HHMMSS}.json`.
    pub fn file_name(&self, kind: &str) -> String {
        format!(
            "{kind}_{}_{}T{}.json",
            self.machine.hostname,
            self.date,
            self.time.replace(':', "")
        )
    }
}

/// Civil UTC date and time `(YYYY-MM-DD, HH:MM:SS)` of now.
pub fn utc_now() -> (String, String) {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0) as i64;
    let (days, rem) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    // Howard Hinnant's days-to-civil algorithm.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    (
        format!("{y:04}-{m:02}-{d:02}"),
        format!("{:02}:{:02}:{:02}", rem / 3600, (rem % 3600) / 60, rem % 60),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn date_is_plausible() {
        let (d, t) = utc_now();
        assert_eq!(d.len(), 10);
        assert!(d.as_str() > "2024-01-01", "{d}");
        assert_eq!(t.len(), 8);
    }
}
