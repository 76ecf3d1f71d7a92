// A stand-in for a hung node agent (test/e2e/signals.test.ts): it prints a ready line as `swactor node` does, then
// ignores SIGTERM, as an agent stuck in native code would; only SIGKILL (or its parent's pipe closing) ends it.
process.on("SIGTERM", () => {})
process.stdin.on("data", () => {})
process.stdin.on("end", () => process.exit(0))
process.stdin.resume()
const data = { _tag: "Tcp", host: "127.0.0.1", port: 9 }
process.stdout.write(`swactor-node-ready ${JSON.stringify({ host: "127.0.0.1", port: 9, data, pid: process.pid })}\n`)
