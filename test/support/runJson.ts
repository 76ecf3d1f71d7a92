/** What the tests that read `swactor run --json` share: its command line and its JSON line. */

/** `run --json` on `model` (after the CLI's entry): `prompt`, `maxTokens` tokens, 1 engine thread, then `extra`. */
export const runJsonArgs = (
  model: string,
  prompt: string,
  maxTokens: number,
  extra: ReadonlyArray<string> = []
): Array<string> => [
  "run",
  "--model",
  model,
  "--prompt",
  prompt,
  "--max-tokens",
  String(maxTokens),
  "--threads",
  "1",
  "--json",
  ...extra
]

/** The run's JSON: the last line `swactor run --json` wrote. */
export const runJsonOutput = <A>(stdout: string): A => JSON.parse(stdout.trim().split("\n").at(-1)!) as A
