/**
 * `--help`, written from each command's `CommandDoc` (cli/FlagSpec.ts) rather than @effect/cli's help: flags under
 * headings by what they are for, one entry each with its value, its text and its default, wrapped to the terminal
 * (at most 100 columns; 100 when stdout is not a terminal), examples at the end. The top-level help lists the
 * commands, one line each.
 */
import type { CommandDoc, FlagDoc } from "./FlagSpec.js"

/** The widest help line, whatever the terminal. */
export const maxHelpWidth = 100

/** The help's width for a stream: its columns when it is a terminal, at most `maxHelpWidth`; else `maxHelpWidth`. */
export const helpWidth = (stream: { readonly isTTY?: boolean; readonly columns?: number }): number =>
  stream.isTTY === true && stream.columns !== undefined && stream.columns > 0
    ? Math.min(stream.columns, maxHelpWidth)
    : maxHelpWidth

/** Joins the words of a short piece of text so that `wrap` keeps it on one line. */
const unbroken = (text: string) => (text.length <= 32 ? text.replaceAll(" ", nbsp) : text)
const nbsp = "\u00a0"

/** `text` in lines of at most `width` characters, broken between words (a longer word is cut). */
const wrap = (text: string, width: number): ReadonlyArray<string> =>
  wrapWords(text, width).map((line) => line.replaceAll(nbsp, " "))

const wrapWords = (text: string, width: number): ReadonlyArray<string> => {
  const lines: Array<string> = []
  let line = ""
  for (let word of text.split(/[ \t\n]+/).filter((w) => w !== "")) {
    while (word.length > width) {
      if (line !== "") lines.push(line)
      lines.push(word.slice(0, width))
      word = word.slice(width)
      line = ""
    }
    if (line === "") line = word
    else if (line.length + 1 + word.length <= width) line += " " + word
    else {
      lines.push(line)
      line = word
    }
  }
  if (line !== "" || lines.length === 0) lines.push(line)
  return lines
}

/** `text` wrapped to `width`, each line after `indent`, the first after `first` instead when given. */
const indented = (text: string, width: number, indent: string, first = indent): ReadonlyArray<string> =>
  wrap(text, Math.max(1, width - indent.length)).map((line, i) => (i === 0 ? first : indent) + line)

/** The left column of a flag: `-o, --output PATH` or `    --model PATH`. */
const flagName = (flag: FlagDoc, shortColumn: boolean): string => {
  const short = flag.aliases.find((alias) => alias.length === 1)
  const prefix = short !== undefined ? `-${short}, ` : shortColumn ? "    " : ""
  return `${prefix}--${flag.name}${flag.value === undefined ? "" : " " + flag.value}`
}

/** A flag's text with what the declaration adds: long aliases, the choices behind a value word, the default. */
const flagText = (flag: FlagDoc): string => {
  const aliases = flag.aliases.filter((alias) => alias.length > 1).map((alias) => `--${alias}`)
  return [
    flag.text,
    aliases.length === 0 ? "" : `(also ${aliases.join(", ")})`,
    flag.choices === undefined || flag.value === flag.choices.join("|") ? "" : `[one of: ${flag.choices.join(", ")}]`,
    flag.required ? "[required]" : flag.shownDefault === undefined ? "" : unbroken(`[default: ${flag.shownDefault}]`)
  ]
    .filter((part) => part !== "")
    .join(" ")
}

/** Entries whose left column is wider than this put their text on the next line. */
const maxLeftColumn = 24
/** Below this many columns for the text, every entry puts its text on the next line. */
const minTextColumn = 30

/**
 * The lines of two-column entries (name, text) laid out together: the text wrapped beside the names, in one column
 * for them all, or below a name too wide for it (every name, on a narrow terminal).
 */
const entryLayout = (names: ReadonlyArray<string>, width: number) => {
  const left = Math.min(maxLeftColumn, Math.max(...names.map((name) => name.length)))
  const textColumn = 2 + left + 2
  const stacked = width - textColumn < minTextColumn
  return ([name, text]: readonly [string, string]): ReadonlyArray<string> =>
    stacked || name.length > left
      ? [`  ${name}`, ...indented(text, width, " ".repeat(stacked ? 8 : textColumn))]
      : indented(text, width, " ".repeat(textColumn), `  ${name.padEnd(left)}  `)
}

const entries = (rows: ReadonlyArray<readonly [string, string]>, width: number): ReadonlyArray<string> =>
  rows.flatMap(
    entryLayout(
      rows.map(([name]) => name),
      width
    )
  )

const section = (title: string, width: number, lines: ReadonlyArray<string>): ReadonlyArray<string> => [
  "",
  ...wrap(`${title}:`, width),
  ...lines
]

const examples = (doc: Pick<CommandDoc, "examples">, width: number): ReadonlyArray<string> =>
  doc.examples.length === 0
    ? []
    : section(
        "Examples",
        width,
        doc.examples.flatMap(({ what, command }, i) => [
          ...(i === 0 ? [] : [""]),
          ...indented(what, width, "  # "),
          ...indented(command, width, "      ", "  ")
        ])
      )

/** A command's help: its summary, usage, flags by heading, examples. */
export const commandHelp = (doc: CommandDoc, width: number): string => {
  const shortColumn = doc.flags.some((flag) => flag.aliases.some((alias) => alias.length === 1))
  const help: readonly [string, string] = ["-h, --help", "print this help"]
  const rows = new Map(doc.flags.map((flag) => [flag, [flagName(flag, shortColumn), flagText(flag)] as const]))
  // One layout for every heading, so the text column lines up through the whole help.
  const entry = entryLayout([...[...rows.values()].map(([name]) => name), help[0]], width)
  const groups = [...new Set([...doc.groups, ...doc.flags.map((flag) => flag.group)])]
  const usage = [
    `swactor ${doc.name}`,
    ...doc.flags
      .filter((flag) => flag.required)
      .map((flag) => `--${flag.name}${flag.value === undefined ? "" : " " + flag.value}`),
    "[OPTIONS]"
  ].join(" ")
  return [
    ...wrap(doc.summary, width),
    "",
    ...indented(usage, width, "         ", "Usage: "),
    ...groups.flatMap((group) => {
      const flags = doc.flags.filter((flag) => flag.group === group)
      return flags.length === 0
        ? []
        : section(
            group,
            width,
            flags.flatMap((flag) => entry(rows.get(flag)!))
          )
    }),
    ...section("Options", width, entry(help)),
    ...examples(doc, width)
  ].join("\n")
}

/** The top-level help: the commands, one line each, and the options of `swactor` itself. */
export const topHelp = (
  about: { readonly version: string; readonly summary: string; readonly examples: CommandDoc["examples"] },
  commands: ReadonlyArray<CommandDoc>,
  width: number
): string =>
  [
    ...wrap(`swactor ${about.version}: ${about.summary}`, width),
    "",
    "Usage: swactor <COMMAND> [OPTIONS]",
    ...section(
      "Commands",
      width,
      entries(
        commands.map((command) => [command.name, command.summary]),
        width
      )
    ),
    ...section(
      "Options",
      width,
      entries(
        [
          ["-h, --help", "print this help; swactor <COMMAND> --help: that command's flags"],
          ["    --version", "print the version"]
        ],
        width
      )
    ),
    ...examples(about, width)
  ].join("\n")
