/**
 * One declaration per flag, read by both the parser and the help: a `Flag` holds the @effect/cli `Options` that parse
 * it and the `FlagDoc` that `--help` prints (group, value, one-line text, default). A default is given once, as the
 * value the parser falls back to, and the help shows that value; an optional flag the command works out for itself
 * says in a few words what it does instead. A command's help is a `CommandDoc` built from the same record of flags
 * its `Command.make` gets through `optionsOf` (cli/Help.ts renders it).
 */
import * as Options from "@effect/cli/Options"
import type { Option } from "effect"

/** What `--help` says about one flag. */
export interface FlagDoc {
  /** The long name, without its dashes. */
  readonly name: string
  /** Other names: one letter is shown as `-o`, a word as `--nodes`. */
  readonly aliases: ReadonlyArray<string>
  /** What the flag takes, as help shows it (`N`, `PATH`, `on|off`); none: a switch. */
  readonly value: string | undefined
  /** The help's heading the flag is listed under. */
  readonly group: string
  /** One line: what the flag is for. */
  readonly text: string
  /** The default as help shows it; none: no default (absent, the command does without). */
  readonly shownDefault: string | undefined
  readonly required: boolean
  /** The values a choice flag takes. */
  readonly choices: ReadonlyArray<string> | undefined
}

/** A flag: its parser and what the help says about it. */
export class Flag<A> {
  constructor(
    readonly options: Options.Options<A>,
    readonly doc: FlagDoc
  ) {}

  /** Absent: `Option.none()`. `whenAbsent`: what the command does then, as help shows the default. */
  optional(whenAbsent?: string): Flag<Option.Option<A>> {
    return new Flag(Options.optional(this.options), { ...this.doc, required: false, shownDefault: whenAbsent })
  }

  /** Absent: `value`, which help shows (as `shown`, where the value alone would not say it). */
  withDefault(value: A, shown: string = String(value)): Flag<A> {
    return new Flag(Options.withDefault(this.options, value), { ...this.doc, required: false, shownDefault: shown })
  }

  /** Another name for the flag (one letter: `-o`). */
  withAlias(alias: string): Flag<A> {
    return new Flag(Options.withAlias(this.options, alias), { ...this.doc, aliases: [...this.doc.aliases, alias] })
  }

  map<B>(f: (a: A) => B): Flag<B> {
    return new Flag(Options.map(this.options, f), this.doc)
  }
}

/** Where a flag is listed, what it is for, and (where the kind's own word would say less) what it takes. */
export interface FlagInfo {
  readonly group: string
  readonly text: string
  readonly value?: string
}

const docOf = (name: string, value: string | undefined, info: FlagInfo, required: boolean): FlagDoc => ({
  name,
  aliases: [],
  value: info.value ?? value,
  group: info.group,
  text: info.text,
  shownDefault: undefined,
  required,
  choices: undefined
})

/** A whole number (`N`). */
export const integer = (name: string, info: FlagInfo): Flag<number> =>
  new Flag(Options.integer(name), docOf(name, "N", info, true))

/** A number (`N`). */
export const float = (name: string, info: FlagInfo): Flag<number> =>
  new Flag(Options.float(name), docOf(name, "N", info, true))

/** Text (`TEXT`). */
export const text = (name: string, info: FlagInfo): Flag<string> =>
  new Flag(Options.text(name), docOf(name, "TEXT", info, true))

/** A file path (`PATH`; its existence is the command's to check). */
export const file = (name: string, info: FlagInfo): Flag<string> =>
  new Flag(Options.file(name), docOf(name, "PATH", info, true))

/** A model path (`PATH`): a file, or a folder holding one model (its existence is the command's to check). */
export const modelPath = (name: string, info: FlagInfo): Flag<string> =>
  new Flag(Options.text(name), docOf(name, "PATH", info, true))

/** A switch: present is true. */
export const boolean = (name: string, info: FlagInfo): Flag<boolean> =>
  new Flag(Options.boolean(name), docOf(name, undefined, info, false))

/** One of `choices`, shown as `a|b|c`, or as `info.value` with the choices listed after the text. */
export const choice = <const C extends ReadonlyArray<string>>(
  name: string,
  choices: C,
  info: FlagInfo
): Flag<C[number]> =>
  new Flag(Options.choice(name, choices), {
    ...docOf(name, choices.join("|"), info, true),
    choices
  })

/** What `--help` says about one command. */
export interface CommandDoc {
  readonly name: string
  /** One line: what the command does. */
  readonly summary: string
  /** The headings in the order help lists them (a flag's group not named here comes after them). */
  readonly groups: ReadonlyArray<string>
  readonly flags: ReadonlyArray<FlagDoc>
  /** Command lines, each after a line saying what it does. */
  readonly examples: ReadonlyArray<{ readonly what: string; readonly command: string }>
}

type Flags = { readonly [key: string]: Flag<any> }

/** What a record of flags parses into: each key's value as the command gets it. */
export type ArgsOf<F extends Flags> = { readonly [K in keyof F]: F[K] extends Flag<infer A> ? A : never }

/** The @effect/cli options of a record of flags, for `Command.make`. */
export const optionsOf = <F extends Flags>(flags: F): { readonly [K in keyof F]: F[K]["options"] } =>
  Object.fromEntries(Object.entries(flags).map(([key, flag]) => [key, flag.options])) as {
    readonly [K in keyof F]: F[K]["options"]
  }

/** A command's help, from the same record of flags its parser is built from. */
export const commandDoc = (
  name: string,
  summary: string,
  groups: ReadonlyArray<string>,
  flags: Flags,
  examples: CommandDoc["examples"]
): CommandDoc => ({ name, summary, groups, flags: Object.values(flags).map((flag) => flag.doc), examples })
