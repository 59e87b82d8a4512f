//! `quantem-gpu device`: which backends can run here.

use crate::args::DeviceArgs;
use crate::print_out;

pub fn run(a: &DeviceArgs) -> anyhow::Result<()> {
    let backends = qem::available_backends();
    let auto = qem::resolve_backend(qem::BackendRequest::Auto)
        .map(|b| b.name().to_string())
        .ok();
    if a.json {
        let v = serde_json::json!({ "backends": backends, "auto": auto });
        return print_out(&format!("{}\n", serde_json::to_string_pretty(&v)?));
    }
    let mut s = String::new();
    for b in &backends {
        let state = if b.available {
            "available"
        } else {
            "unavailable"
        };
        s.push_str(&format!("{:<5} {:<12} {}\n", b.name, state, b.detail));
    }
    if let Some(auto) = auto {
        s.push_str(&format!("--backend auto uses: {auto}\n"));
    }
    print_out(&s)
}
