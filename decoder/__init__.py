"""echospec.decoder"""
