//! One module per subcommand.

pub mod bench;
pub mod describe;
pub mod eval;
pub mod fixtures;
pub mod load;
pub mod models;
pub mod plan;
pub mod probe;
pub mod pull;
pub mod run;
pub mod serve;
pub mod synth;
pub mod tokenize;

/// Prints an error and its causes on one line, the way every subcommand reports failure.
pub fn report_error(e: &anyhow::Error) {
    let mut msg = format!("error: {e}");
    for cause in e.chain().skip(1) {
        let c = cause.to_string();
        if !msg.contains(&c) {
            msg.push_str(": ");
            msg.push_str(&c);
        }
    }
    eprintln!("{msg}");
}
