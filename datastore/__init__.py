"""echospec.datastore"""
