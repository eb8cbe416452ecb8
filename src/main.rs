use std::process::ExitCode;

fn main() -> ExitCode {
    keyshift::cli::main()
}
